"""speedrun: train a GPT to a target validation loss as fast as the hardware allows.

Subpackages: ``data`` (shards, tokenizers, loaders), ``model`` (the networks), ``attention``
(attention backends behind one call), ``kernels`` (Triton kernels, each beside its PyTorch
reference), ``optim`` (optimizers and schedules), ``train`` (the loop, checkpoints, run folders)
and ``evidence`` (benchmarks, statistics, profiles, environment checks).  Importing any of them
needs no GPU, network, data or tokenizer download.
"""

__version__ = "0.1.0"
