"""Loading a model: the files (model_loader.py: HF folders and GGUF), GGUF
weights (gguf_weights.py, over proto's GGUF reader), dummy weights, and the
incremental detokenizer over the tokenizer that proto/tokenizer.py loads."""
