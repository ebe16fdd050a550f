"""Speculators on disk: SSM pools, the feature drafter's files, draft vocabularies, resolving --ssm specs."""
