"""Deployment: the services as Ray actors (``disco up/down/status``, whose commands live in :mod:`disco_cli.commands.ray`), the Dockerfile and
the KubeRay manifests (see ``docs/deploy.md``).

Only this package imports Ray; the core (:mod:`disco`) never does.
"""
