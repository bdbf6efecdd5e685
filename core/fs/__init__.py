"""File-system helpers: atomic directory commits, fsync, free space and stale temporary folders
(:mod:`ferrule.fs.util`), kernel locks on run folders and outputs (:mod:`ferrule.fs.locks`),
checkpoint checksums (:mod:`ferrule.fs.integrity`), the output folder of a conversion or export
(:mod:`ferrule.fs.output_dir`) and the layout of a ``ferrule train`` run folder
(:mod:`ferrule.fs.run_layout`).

Importing this package imports nothing; no module here imports torch at import time.
"""
