"""Test-only stand-in for the official trainer's package (``aiak_training_llm``): only the sample types its
datasets name in ``.nv-meta/dataset.yaml``, with the official fields, so energon can load an official-layout
folder without the trainer installed. No official code is copied here."""
