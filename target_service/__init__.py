"""The target service: a :class:`~disco.target_engine.TargetEngine` behind
``disco.v1.TargetService`` (prefill and one-forward block verification)."""
