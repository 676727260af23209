from training.tasks.tokenizer import CharTokenizer


def test_round_trip_and_special_ids(tmp_path):
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok.encode("12+7=19", add_bos=True)
    assert ids[0] == 1 and len(ids) == 8
    assert tok.decode(ids) == "12+7=19"
    assert tok.decode([*ids, tok.eos_token_id]) == "12+7=19"
    assert tok.encode("é") == [tok.unk_token_id]
    tok.save(tmp_path)
    again = CharTokenizer.load(tmp_path)
    assert again.encode("a b\n") == tok.encode("a b\n") and again.vocab_size == tok.vocab_size
