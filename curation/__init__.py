"""Curation: ingest → MetaCLIP image / concept embeddings → exact top-K concepts → concept-balanced resampling."""
