-- requires: captions
-- Recaption quality per language: every status is a row (ok, empty, refused, repetition, truncated, wrong_language, too_short, error).
SELECT folder, lang, status, count(*) AS captions, round(avg(length(caption)), 1) AS mean_chars,
       round(avg(tokens), 1) AS mean_tokens, round(avg(script_ratio), 3) AS mean_script_ratio,
       any_value(error) AS example_error
FROM captions GROUP BY ALL ORDER BY folder, lang, status
