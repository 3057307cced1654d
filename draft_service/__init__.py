"""The draft service: a :class:`~disco.draft_engine.DraftEngine` behind ``disco.v1.DraftService``.

The stop policy runs here, next to the draft model, and is asked after every draft
token; the stream of draft tokens ends when it says stop.
"""
