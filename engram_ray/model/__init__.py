"""The model's Engram layout and its pure functions: sizes (`layout`), n-gram hashing
(`hashing`), the reference lookup (`reference`), deterministic table contents (`synthetic`)."""
