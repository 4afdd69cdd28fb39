"""A correct component built on a poor structure: its check passes it, and its cost check warns,
naming the operation whose cost grows (the design lessons' tests, 03 and 11)."""
from minipaged.exercises import workbench
from minipaged.exercises.cost import measure_cost


def assert_correct_but_warned(name: str, variant, operation: str, unit: str) -> str:
    """``variant`` passes component ``name``'s check; its cost verdict is slow, names
    ``operation``, and says the cost grows with the number of ``unit``. Returns the verdict."""
    result = workbench.check_component(name, variant, save=False)
    assert result.passed, str(result)
    verdict = measure_cost(name, variant)
    message = verdict.message()
    print(message)
    assert verdict.slow, message
    assert operation in verdict.slow_operations(), message
    assert f"grows faster with the number of {unit}" in message
    return message
