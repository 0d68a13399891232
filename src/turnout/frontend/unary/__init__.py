"""The one-reply routes: embeddings and tensors."""
