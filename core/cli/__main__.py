"""``python -m ferrule.cli ...``: the ``ferrule`` CLI, as ``python -m ferrule`` (kept: ``ferrule.cli`` was a module
that ran this way before it became a package)."""

from ferrule.cli import main

if __name__ == "__main__":
    main()
