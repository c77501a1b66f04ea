/* Uses the installed libmoe.so through find_package (moe::moe) from C: the
 * ABI version matches the header, and a bad option is a clean
 * MOE_INVALID_ARGUMENT naming the key. Prints "ok" when both hold. */
#include <stdio.h>
#include <string.h>

#include "moe/moe.h"

int main(void) {
  if (moe_abi_version() != MOE_ABI_VERSION) return 1;
  moe_session* s = NULL;
  if (moe_session_open("{\"model\":\"synthetic:tiny\",\"no_such_option\":1}", &s) != MOE_INVALID_ARGUMENT) return 2;
  if (s != NULL || strstr(moe_last_error(), "no_such_option") == NULL) return 3;
  printf("ok: %s\n", moe_last_error());
  return 0;
}
