"""The environment contract and what is compiled from it: the author's side of Stadium.

``contract`` (Environment, StepResult, State), ``tools`` (tool environments), ``spec`` (an env
class compiled once), ``codecs`` (declared types validated and encoded), ``snapshot``.
"""
