"""Helpers for testing code built on tensorwire: ``launch`` runs a function on N local ranks; ``data`` makes
test data that encodes its sender (``rank_pattern``) and finds where it differs (``first_mismatch``)."""

from .data import first_mismatch, rank_pattern
from .launch import RankFailedError, free_port, launch

__all__ = ["launch", "free_port", "RankFailedError", "rank_pattern", "first_mismatch"]
