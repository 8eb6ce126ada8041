"""``lwm play``: the learned world on a local web page (:mod:`lwm.play.server`), one KV-cached frame per key press."""
