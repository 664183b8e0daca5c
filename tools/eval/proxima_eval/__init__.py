"""Proxima offline quality tool: a numpy Llama forward pass over a GGUF file, KV-cache export
(.pkv files for the codec benchmark and trace replay), and the evaluation of what storing the KV
cache through a STAR-KV codec plan costs in perplexity, KL divergence and top-1 agreement.

Everything runs on CPU in numpy; nothing is downloaded at run time.
"""
