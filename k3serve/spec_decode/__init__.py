"""Speculative decoding: drafters (ngram, dspark, draft_model), lossless verification
(standard and block), and KDA state rollback to the last accepted token."""
