"""ovpipe: data curation, packing, pretraining and RL-data selection for LLaVA-OneVision-1.5-style models."""
__version__ = "0.1.0"
