"""Stop policies: decide, after each draft token, whether to keep drafting."""

from disco.speculation.policies.auto import reads_costs, with_costs
from disco.speculation.policies.base import Decision, StopPolicy, block_budget
from disco.speculation.policies.spec import POLICY_INFOS, PolicyFactory, PolicySpec, parse_policy_spec

__all__ = ["Decision", "StopPolicy", "POLICY_INFOS", "PolicyFactory", "PolicySpec", "parse_policy_spec",
           "reads_costs", "with_costs", "block_budget"]
