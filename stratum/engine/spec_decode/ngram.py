"""Prompt lookup: proposals copied from the request's own tokens, after an earlier occurrence of its
latest n-gram (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram proposer and llama.cpp's lookup
decoding do the same)."""

from __future__ import annotations

# Of the occurrences of the latest n-gram, the most recent this many are compared further back: the
# one whose match runs longest is the copy being made (a file quoted in the prompt, rewritten in the
# answer), not merely a line that recurs in it.
CANDIDATES = 16
# Matches are measured up to this many tokens: long enough to tell a copy from a recurring phrase.
MAX_MATCH = 32


class NgramIndex:
    """Every n-gram (min_n <= n <= max_n) of one request's tokens, with the positions that followed
    each occurrence; extended as the request grows, so a lookup is a few dictionary reads.

        tokens:  ... a b c [d] ... a b c          the suffix "a b c" occurred before, followed by d:
        propose:                         d ...    the tokens from d on
    """

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.follows: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after each occurrence
        self.num_indexed = 0  # occurrences ending before this position are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (their next token is known)."""
        follows = self.follows
        for end in range(max(self.num_indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                seen = follows.get(key)
                if seen is None:
                    follows[key] = [end]
                else:
                    seen.append(end)
        self.num_indexed = max(self.num_indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest earlier match of the tokens' suffix.

        Returns:
            (the proposal, how many tokens of the suffix the chosen occurrence matches, up to
            MAX_MATCH); ([], 0) when no n-gram of at least min_n tokens recurs.
        """
        if k <= 0:
            return [], 0
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            ends = self.follows.get(tuple(tokens[length - n :]))
            if not ends:
                continue
            best, best_len = ends[-1], n
            for end in reversed(ends[-CANDIDATES:]):
                m = n
                while m < MAX_MATCH and end - m > 0 and tokens[end - m - 1] == tokens[length - m - 1]:
                    m += 1
                if m > best_len:
                    best, best_len = end, m
            return tokens[best : best + k], best_len
        return [], 0
