"""``python -m ferrule ...``: the ``ferrule`` CLI (what ``torchrun -m ferrule train CONFIG`` runs on each rank)."""

from ferrule.cli import main

if __name__ == "__main__":
    main()
