"""How the model is spread over the ranks (``parallel=ddp|fsdp|hsdp``): one class per option, ``base.Parallelism``."""
