// gradcheck cases written here rather than read from the op's record: dropout (one mask
// for every finite-difference evaluation).
#include "tests/autograd/gradcheck_cases.h"

namespace tessera::gradcheck_cases {

void add_nn_cases(Table& t) {
  // dropout: a fresh generator per evaluation (its record's cases draw the mask once).
  t[OpId::dropout] = {[](Maker& mk) {
                        // A fresh generator per call: every finite-difference evaluation draws the
                        // same mask.
                        auto fn = GradcheckFn([](const Tensors& in) {
                          Generator g(99);
                          return dropout(in[0], 0.3, true, &g);
                        });
                        return CaseList{
                            {Covers::contiguous, "p = 0.3", {mk.normal({4, 6})}, fn},
                            {Covers::noncontiguous,
                             "p = 0.3, transposed",
                             {mk.normal({4, 6}, Memory::permuted)},
                             fn},
                            {Covers::noncontiguous,
                             "p = 0.3, strided",
                             {mk.normal({2, 3, 4}, Memory::strided)},
                             fn},
                        };
                      },
                      ""};
}

}  // namespace tessera::gradcheck_cases
