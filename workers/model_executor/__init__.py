"""Running the model: loading weights and tokenizers, the model runner that
turns a scheduled batch into one forward pass, models/ and layers/."""
