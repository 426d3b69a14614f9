def test_import():
    import multiworld_rs
