"""The documented default scenario of ``verl-ext sim`` (no workload or preset flags):
a synthetic long-tail GRPO rollout on a GPU cluster preset."""

DEFAULT_PRESET = "h100-7b"
DEFAULT_INSTANCES = 32
#: SynthConfig fields of the default workload: 256 prompts x 16 samples = 4,096 requests
DEFAULT_SYNTH = {"prompts": 256, "samples": 16, "epochs": 2, "mean_len": 4096, "max_len": 16384}
