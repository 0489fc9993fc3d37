"""Tooling around the inference engine: turning an AR checkpoint into a block-diffusion one
(`convert`), stage-1 training (`train`, `train_data`, with its own autograd-friendly forward
pieces in `forward`), evaluation (`evaluate`) and their command-line parsers (`cli`). The
engine and the request path never import it; `canvas serve` uses `convert` only to build the
default model on first start."""
