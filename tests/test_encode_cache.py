from __future__ import annotations

from mtplx.server.encode_cache import EncodeCache


def test_hits_are_copies_and_keys_cover_route_template_identity():
    cache = EncodeCache("model-a", "template-1")
    key = cache.key("chat", b'{"messages": []}')
    cache.put(key, [1, 2, 3], {})
    got, _ = cache.get(key)
    got.append(99)
    assert cache.get(key)[0] == [1, 2, 3]
    assert key != cache.key("messages", b'{"messages": []}')
    assert key != EncodeCache("model-a", "template-2").key("chat", b'{"messages": []}')
    assert key != EncodeCache("model-b", "template-1").key("chat", b'{"messages": []}')


def test_lru_capacity_and_off_switch(monkeypatch):
    cache = EncodeCache("m", "t", capacity=2)
    for i in range(3):
        cache.put(str(i), [i], {})
    assert cache.get("0") is None and cache.get("2") == ([2], {})
    monkeypatch.setenv("MTPLX_ENCODE_CACHE", "off")
    off = EncodeCache("m", "t")
    off.put("k", [1], {})
    assert off.get("k") is None


def test_dated_templates_key_by_day():
    assert EncodeCache("m", "{{ strftime_now('%Y') }}").dated and not EncodeCache("m", "plain").dated
