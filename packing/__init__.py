"""Packing: exact multimodal token lengths and offline hash-bucket best-fit-decreasing packing.

Light on purpose: numpy, pyarrow and (for ``lengths``) a transformers tokenizer — never torch.
"""
