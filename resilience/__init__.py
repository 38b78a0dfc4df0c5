"""resilience-bench: measure fault-tolerance techniques for distributed training under real injected faults."""

import warnings

# The peer libraries (dlrover, nvidia-resiliency-ext) depend on the `pynvml` package, a deprecated shim over
# nvidia-ml-py that warns whenever torch.cuda imports it: in every process, on every run. The module still works.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)

__version__ = "0.1.0"
