"""Engine adapters: the code the rewritten engine call sites reach (one subpackage per engine)."""
