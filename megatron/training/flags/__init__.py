"""What the parsed flags must satisfy, and what they leave to derive.

A module of checks per section of Megatron-LM's flags (model, parallel, moe,
batch, pipeline, training, precision, data, checkpoint, logs, gpu), the
derived defaults (defaults.py), and checks.validate, which runs them all.
megatron/training/arguments.py parses the flags and calls them."""
