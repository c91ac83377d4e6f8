"""Running the model: the executor (executor/), loading a model and its
tokenizer (loader/), running a rank (runner/: the rank worker and the model
runner that turns a scheduled batch into one forward pass), sizing memory
(memory/), sampling (sampling/), models/, layers/ and platforms/ (the
compiled CPU kernels and the one-call CPU decode step)."""
