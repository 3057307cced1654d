"""The target service: a :class:`~disco.engines.target.TargetEngine` behind
``disco.v1.TargetService`` (prefill and one-forward block verification)."""
