"""Loading a model: the files (model_loader.py: HF folders and GGUF), GGUF's
reader, weights and SentencePiece tokenizer, dummy weights, and the
incremental detokenizer over the loaded tokenizer."""
