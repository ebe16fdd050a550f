"""Speculators on disk: SSM pools, the feature drafter's files, EAGLE-3 heads, draft vocabularies, resolving --ssm
specs."""
