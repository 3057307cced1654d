"""The draft service: a :class:`~disco.engines.draft.DraftEngine` behind ``disco.v1.DraftService``.

The stop policy runs here, next to the draft model, and is asked after every draft
token; the stream of draft tokens ends when it says stop.
"""
