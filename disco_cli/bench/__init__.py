"""Live benchmark: every policy side by side, interleaved per prompt, in process and
over gRPC, with HF transformers' assisted generation as a peer (``disco bench``)."""
