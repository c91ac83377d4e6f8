"""Short prompts the failover and autoscaling tests share (varied lengths and starts)."""

SHORT_PROMPTS = [
    "The quick brown fox",
    "Paged attention keeps",
    "def add(a, b):",
    "Hello, world! How are",
    "Numbers: 0 1 2",
    "Continuous batching rebuilds",
    "I am fine, thank",
    "keys and values in",
]
