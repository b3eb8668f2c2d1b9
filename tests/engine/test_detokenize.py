from veloxquant_mlx.engine.detokenize import IncrementalDetokenizer


def test_pieces_concatenate_to_the_full_decode_and_arrive_early(default_model):
    _, tokenizer = default_model
    text = "héllo wörld, naïve café 123 — done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) + detok.finalize() == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[0] == tokenizer.decode(ids[:1])  # the first token's text is not held back
    assert sum(1 for p in pieces if p) > len(text.split())  # finer than word by word


def test_an_unfinished_character_is_released_at_the_end(default_model):
    _, tokenizer = default_model
    ids = tokenizer.encode("é")
    detok = IncrementalDetokenizer(tokenizer)
    held = [detok.add(t) for t in ids[:-1]]
    assert "".join(held) == "" or "\ufffd" not in "".join(held)
    assert detok.finalize() != "" or len(ids) == 1
