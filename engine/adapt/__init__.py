"""Tooling around the inference engine: turning an AR checkpoint into a block-diffusion one
(`convert`), stage-1 training (`train`, `train_data`, with its own autograd-friendly forward
pieces in `forward`), evaluation (`evaluate`); their commands are `canvas convert`, `train` and
`eval` (`server.cli.tools`). The engine and the request path never import it; `canvas serve`
uses `convert` only to build the default model on first start."""
