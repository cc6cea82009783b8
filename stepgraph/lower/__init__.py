"""Lowering and execution: the reference executor (plain torch), caller-owned caches, weight
loading (safetensors checkpoints, random weights) and the decode-step driver. Imports torch;
the compile path never imports this package."""
