"""Asset builders and rewards of ferrule's example runs, kept out of the ``ferrule`` wheel.

Each builder writes a tiny random model and its task into a folder for a config of
``examples/configs`` (``python -m ferrule_examples.inkling_synthetic OUT_DIR``, ...; ``--help``
says what it writes); the configs name their rewards here (``ferrule_examples.inkling_synthetic:
target_token_share``, ``ferrule_examples.inkling_shapes:square_count_reward``). ``./install.sh``
installs this package (editable) beside ferrule.
"""
