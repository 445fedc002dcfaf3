// What generation and scoring need of a model: run tokens after what one sequence already holds.
// The engine (one of its sequence slots) and the reference model (its KvCache) both provide it.
#pragma once

#include <functional>
#include <span>
#include <vector>

namespace colibri {

// Appends `tokens` to the sequence and returns the logits of every token ([tokens, vocab]) or,
// when all_logits is false, of the last one only ([vocab]).
using ForwardFn = std::function<std::vector<float>(std::span<const int> tokens, bool all_logits)>;

}  // namespace colibri
