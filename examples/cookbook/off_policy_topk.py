"""The tinker-cookbook's off-policy distillation with top-k teacher targets
(``tinker_cookbook.distillation.train_off_policy``), unmodified, from the command line.

tinker-cookbook 0.6.1 ships that trainer as a library (``train_off_policy.main(Config)``) with no
recipe script of its own; this file is the command-line entry its other recipes have
(``chz.entrypoint`` over its own ``Config``) and adds nothing else. Every setting is a chz flag.
"""

import asyncio

import chz
from tinker_cookbook.distillation import train_off_policy

if __name__ == "__main__":
    asyncio.run(train_off_policy.main(chz.entrypoint(train_off_policy.Config)))
