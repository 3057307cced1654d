"""Builders shared by test modules."""

from disco.draft_engine import DraftEngine
from disco.loop import SpeculativeGenerator
from disco.pipeline import make_decode
from disco.policies import PolicyFactory
from disco.target_engine import TargetEngine

EOS_ID = 0

PROMPTS = (
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\nclass Wrapper(object):",
    "x",
)

ALL_POLICIES = ("static:1", "static:3", "static:7", "heuristic:2", "confidence:0.4", "confidence:0.05",
                "adaptive-confidence", "entropy", "entropy:lambda=0.2,adapt=0.05", "oracle")


def local_generator(target, draft, tokenizer, policy_factory=None, eos=(EOS_ID,)):
    drafter = DraftEngine(draft, policy_factory or PolicyFactory()) if draft is not None else None
    return SpeculativeGenerator(drafter, TargetEngine(target), make_decode(tokenizer), eos)
