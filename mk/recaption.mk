# recaption: bilingual (en, zh) captions of a slice of the concept-balanced set, on the CPU, with the
# demo's own exported stage-2 VLM, two prompts, quality statuses and a report (RUN/recaption/report.md).
# Mid-training reads them through lengths/pack `caption_source: recaption:<lang> | both[:<lang>]`
# (in the demo, packing runs before the model that captions exists, and a 30-step model's captions
# fail the quality checks anyway).
#   VLM_MODEL       the HF VLM folder both recaption and the RL rollouts generate with: by default the
#                   demo's stage-2 model as `make pretrain` exports it (HF_EXPORT, mk/pretrain.mk:
#                   RUN/pretrain/hf-stage-2, the published LLaVAOneVision1_5_ForConditionalGeneration
#                   layout), or any HF VLM folder. Where that folder has no config.json (pretrain not
#                   run), a tiny random Qwen2-VL (python -m demo.tiny_vlm) stands in, so the path still
#                   runs end to end.
DEMO_TARGETS += recaption
VLM_MODEL ?= $(abspath $(or $(HF_EXPORT),$(RUN)/pretrain/hf-stage-2))
TINY_VLM = $(abspath $(RUN))/tiny-vlm
# evaluated when a recipe runs (the export may have been written by an earlier target of the same make)
DEMO_VLM = $$(test -f $(VLM_MODEL)/config.json && echo $(VLM_MODEL) || \
             { $(BIN)/python -m demo.tiny_vlm --out $(TINY_VLM) --run-dir $(RUN) >&2 && echo $(TINY_VLM); })

.PHONY: recaption
recaption:
	$(OVPIPE) recaption --config configs/demo/recaption.yaml --set model=$(DEMO_VLM) \
	  --set only_balanced=$$(test -d $(RUN)/balance/balanced && echo true || echo false) $(STEP_ARGS)
	$(OVPIPE) sql $(RUN) "SELECT lang, status, count(*) AS captions, round(avg(length(caption)), 1) AS mean_chars FROM captions GROUP BY ALL ORDER BY ALL"
