"""rlt2t.common: what the learner, the actors and the services share (imports nothing of ours outside it)."""

from rlt2t.common.ct2_cpu import prefer_accurate_int8

prefer_accurate_int8()  # before anything loads ctranslate2, which reads CT2_USE_MKL once
