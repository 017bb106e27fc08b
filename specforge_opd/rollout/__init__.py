"""Target-assisted speculative rollout: the one draft/verify step, the in-process engine and decode backend, response generation, rollout records and their shards."""
