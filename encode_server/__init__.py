"""encode-server: a standalone vision-encoder service for EPD-disaggregated multimodal serving."""
__version__ = "0.1.0"
