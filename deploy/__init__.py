"""Deployment: the services as Ray actors (``disco up/down/status``), the Dockerfile and
the KubeRay manifests (see ``docs/deploy.md``).

Only this package imports Ray; the core (:mod:`disco`) never does.
"""
