"""KV tiers behind one connector (vLLM v1's KV connector seam): base.py the
interface, keys.py the keys that survive restarts, offloading.py the tiers'
connector, factory.py how --kv-connector picks one."""
