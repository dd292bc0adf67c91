// The header TUs of one layer linked together (tests/headers/CMakeLists.txt): nothing runs.
int main() {
  return 0;
}
